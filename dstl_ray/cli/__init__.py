"""The ``dstl-ray`` command: deploy, status, inspect, demo."""
