"""The Ray runner: workers as Ray actors that load their stages from bytes and never import the user's code.

Owns starting or joining Ray, clocks, placement groups and why an actor waits
(``setup``), the actor (``actor``), the sockets between actors (``wire``,
``peers``) and an actor's inbox (``inbox``), the one step-timeout wait and dead-actor
reports (``waiting``), a step as a Compiled Graph (``compiled``) and ``RayPipeline``
(``pipeline``: a runner's actors placed, loaded, waited on and described, and its steps).
"""
