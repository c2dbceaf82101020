"""The serving layer: audio intake, batching, the engine, HTTP API, bulk jobs and the command line."""
