"""``python -m kvoffload.tools.bench.vllm_p2p``: the ``kvoffload bench vllm-p2p`` command."""

from kvoffload.tools.bench.vllm_p2p.command import vllm_p2p

if __name__ == "__main__":  # not when a spawned producer imports this file as its __mp_main__
    vllm_p2p()
