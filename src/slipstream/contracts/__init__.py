"""What the agent, the router and the operator share: the gRPC control API, metric
names, and the OpenAI error shape. Imports nothing else of Slipstream."""
