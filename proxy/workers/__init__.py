"""The serving workers as the proxy sees them: which worker serves a call (`routing.py`), the generation
plan and the worker's answer read into results (`plan.py`), generating with failover (`calls.py`), and
resuming generations a weight push aborted or a lost worker cut off (`resume.py`, `resume_stream.py`).

May import the proxy's kernel and the serving client, never conversations, recording or the APIs."""
