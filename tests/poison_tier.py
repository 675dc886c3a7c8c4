"""An out-of-tree tier for tests (CASES C25): the fs tier with its worker I/O in ``poison_io``, a
module outside the package whose I/O misbehaves for the keys named in ``poison``."""

import msgspec
from poison_io import PoisonIOConfig

from kvoffload.tiers.fs import FsTier, FsTierConfig


class PoisonTierConfig(FsTierConfig, forbid_unknown_fields=True, kw_only=True):
    """``poison``: chunk key hex -> ``ValueError`` / ``MemoryError`` / ``struct.error`` (raised by
    that key's store and load) or ``tuple`` (answered instead of an IOOutcome)."""

    poison: dict[str, str] = {}


class PoisonTier(FsTier):
    config_class = PoisonTierConfig
    io_module = "poison_io"

    def io_config(self) -> PoisonIOConfig:
        fs = msgspec.structs.asdict(super().io_config())
        return PoisonIOConfig(**fs, poison=dict(self.config.poison))
