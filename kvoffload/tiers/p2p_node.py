"""Deprecated: ``parse_peer`` moved to :mod:`kvoffload.tiers.p2p`; this module stays only until
``tools/config_check.py`` imports it from there."""

from kvoffload.tiers.p2p import parse_peer as parse_peer
