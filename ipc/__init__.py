"""Inter-process plumbing: the shared-memory host arena (and the janitor process that removes an
arena whose owner died), the job/result wire schema, and ZMQ channels.

Imports nothing else of the project (dependencies point one way: tools → kvoffload → workers, ipc).
"""
