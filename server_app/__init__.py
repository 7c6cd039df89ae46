"""The Tessera ServerApp (Flower component ``server_app.app:app``)."""
