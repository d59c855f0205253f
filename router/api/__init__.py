"""What every API door shares: the call path (service.py: counted, traced, admitted, validated),
authentication, tracing and TLS. Imports router.core and router.scheduling.
"""
