"""The processes of a run: spawning children and the template of a child's main (``procs``), logging set-up
(``logs``), the fault hooks of tests and drills (``faults``) and how much of its time each process works
(``balance``)."""
