"""The gRPC edge: the servicer, the protobuf conversion, the mailboxes that carry a
request's events to it, the options and the metrics."""
