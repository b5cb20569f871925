"""Federated FedMVP on Flower: client_app / server_app (the apps), strategy (rounds and server maths),
task (a worker's context and local training), wire (tensors in messages), evaluation, prepare (creating a
run: its record) and simulation (`fedmvp train`)."""
