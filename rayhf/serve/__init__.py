"""Serving a trained policy: an OpenAI-compatible HTTP API on Ray Serve.

``protocol`` (HTTP messages) <- ``app`` (Ray Serve deployment, ``build_app``) -> ``engine``
(the seam in front of the generation engine); ``cli`` is the ``rayhf serve`` command.
"""
