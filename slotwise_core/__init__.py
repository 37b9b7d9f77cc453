"""What both services share and neither owns.

The llama.cpp/libmtmd wrapper, the contract's domain types, the gRPC edge and metrics helpers,
and the tiny test models. Imports the stubs and third-party libraries, never a service.
"""
