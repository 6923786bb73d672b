"""End-to-end scenarios: real CLI processes, real nats-servers and clusters, real files; the LLM is the only double."""
