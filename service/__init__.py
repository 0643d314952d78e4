"""gRPC service for jaxserve: the .proto, generated stubs, server and client."""
