"""`specserve bench`: load a server with prompts by category and concurrency, speculation on and
off in paired rounds, and write a report (tables, plots, results JSON) with peers beside it."""
