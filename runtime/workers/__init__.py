"""The workers: agent, model and resource workers on the transport, the loop they share and control messages.

(Composing them into a running service, and the batch commands, are ``gym_runtime.service``.)
"""
