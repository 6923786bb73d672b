"""The transport: the only code that speaks NATS (connections, request-reply with liveness, JetStream
streams, pulling, blobs, discovery).
"""
