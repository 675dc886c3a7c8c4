"""Inter-process plumbing: the shared-memory host arena, the job/result wire schema, and ZMQ channels.

Imports nothing else of the project (dependencies point one way: tools → kvoffload → workers, ipc).
"""
