"""`python -m board.api`: serve with settings from the environment (DELTABOARD_*)."""

from board.api.server import serve
from board.settings import Settings

serve(Settings())
