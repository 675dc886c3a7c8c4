"""Tools built on the library (installed as ``kvoffload.tools``): the demo, stress and benchmarks."""
