"""Optional ideas on top of the core, one module each, imported only when their setting is on.

Each module names the core's extension point it attaches at (`attach(engine)` for the engine's,
a function the model runner calls for the device's). Deleting this folder leaves a whole engine.
"""
