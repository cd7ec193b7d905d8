"""Which versions are served: the ModelServerConfig (model_config.py) and the model manager that loads, unloads
and resolves versions (model_manager.py), as TF Serving's core/ and server_core."""
