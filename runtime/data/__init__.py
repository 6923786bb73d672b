"""Rows in and out: reading, validating and publishing tasks, reading and collecting results (only their
owners'), aggregate metrics, batch manifests, prepare and reverify.
"""
