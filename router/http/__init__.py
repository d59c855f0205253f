"""The HTTP port: the FastAPI application, health probes and /metrics, the HF TGI REST door and the
OpenAI door. Imports router.api, router.core and router.scheduling (the health checks).
"""
