"""Tessera: heterogeneous-architecture federated learning on Flower."""
