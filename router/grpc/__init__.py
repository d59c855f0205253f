"""The gRPC door (fmaas.GenerationService): the servicer, TGIS's Parameters, our request parsing and
server reflection. Imports router.api and router.core.
"""
