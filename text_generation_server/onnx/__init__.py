"""ONNX: the runtime session with I/O binding (onnx_session.py) and the export behind convert-to-onnx
(onnx_export.py).
"""
