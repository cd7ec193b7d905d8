"""The REST front end (--rest_api_port): routes onto the gRPC servicers, the aiohttp server and its limits, and
TF Serving's JSON codec (json_codec.py)."""
