"""Federated FedMVP on Flower: task (shared logic), client app, server app, strategy, simulation."""
