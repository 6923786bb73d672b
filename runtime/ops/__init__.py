"""Operating a cluster: the embedded nats-server, security (PKI, permissions, provisioning) and status."""
