"""Running a federation across machines: certificates (``certs``), the server side (``superlink``:
`fedmvp serve`), the one SuperNode launch of a site and of an edge device (``supernode``:
`fedmvp join`, `edge-client join`) and the Flower app folder `flwr run` submits (``flower_app``),
all on Flower's Deployment Runtime."""
