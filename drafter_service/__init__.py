"""The drafter service: proposes draft chains (MTP and suffix lookup) over gRPC."""
