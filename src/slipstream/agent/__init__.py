"""The node agent: engine, scheduler, parallel workers, server, router, simulator, benchmarks."""
