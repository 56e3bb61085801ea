"""gRPC protocol definitions (``kvferry.proto``) and generated stubs."""
