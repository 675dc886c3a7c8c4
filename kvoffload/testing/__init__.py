"""Test support for tier authors: the secondary-tier contract suite (:mod:`.tier_contract`).

Nothing in :mod:`kvoffload` imports this package; it needs pytest (the ``test`` extra:
``pip install 'kvoffload[test]'``).
"""
