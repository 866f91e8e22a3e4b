"""`python -m deltaboard.board.server.api`: serve with settings from the environment (DELTABOARD_*)."""

from deltaboard.board.server.api.server import serve
from deltaboard.board.server.settings import Settings

serve(Settings())
