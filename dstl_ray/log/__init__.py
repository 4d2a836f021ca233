"""FLIP-158 "API": the writer, its handles, the client that makes writers, and the requests
they send."""
