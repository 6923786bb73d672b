"""Rows in and out: reading, validating and publishing tasks, collecting results, aggregate metrics,
batch manifests, prepare and reverify.
"""
