"""What the parts of Slipstream share: the request the API hands the engine (``request.py``,
``sampling.py``: pure data, carried unchanged over both transports to the scheduler), the gRPC
control API, metric names and the OpenAI error shape. Imports nothing else of Slipstream."""
