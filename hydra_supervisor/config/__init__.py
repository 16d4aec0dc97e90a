"""Reading what the operator wrote: profiles, the node file, model references."""
