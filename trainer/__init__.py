"""Pure algorithm functions, losses, data loading from storage, Ray actors, weight sync."""
