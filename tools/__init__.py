"""Developer tools run as `python -m tools.<tool>`: offline jobs that build artefacts the engine
loads (an EAGLE-3 head trained for a target: `tools.train_eagle3`). They may import the engine,
never the other way round."""
