"""The command line (``um-lab``) and the lab server it starts."""
