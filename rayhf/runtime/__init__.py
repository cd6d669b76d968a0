"""Role groups on Ray, the driver that runs the graph, checkpoints."""
