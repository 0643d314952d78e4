"""The gRPC front end: the servicer, wire conversion and a Python client."""
