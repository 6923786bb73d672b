"""The workers: agent, model and resource workers on the transport, their composition (runner) and the
process supervisor.
"""
