"""Running a federation across machines: certificates (``certs``), the server side (``superlink``:
`fedmvp serve`) and a site (``supernode``: `fedmvp join`), all on Flower's Deployment Runtime."""
