"""Client side of Tessera: ClientApp handlers, device profiles and local training."""
