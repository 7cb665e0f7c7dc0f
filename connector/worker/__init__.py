"""A worker's side of a step: stores and loads of the plan's blocks, joining the device copies and the client."""
