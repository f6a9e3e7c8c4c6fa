"""The `specserve` command: `serve` (server/), `models` (engine/model/bundled.py), `bench` (bench/).

It sits above the three packages it dispatches to, so none of them imports another's command line.
"""
