"""What the router and the shard processes share, torch-free: the typed messages between them
(messages.py), the internal protobuf code and its conversion (pb/, convert.py), defaults and
socket naming (defaults.py), the engine registry and its capabilities (engines.py), logging
setup (logs.py), model-config reading (model_config.py) and CPU placement (cpu_placement.py).

Imported by router/, text_generation_server/ and launcher/; imports none of them.
"""
