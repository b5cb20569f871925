"""The one ClientApp every SuperNode of a fedmvp federation loads (see ``node_app.client_app``)."""
