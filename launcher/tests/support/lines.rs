//! Lines that another process writes (the fake children's event fifo, the launcher's output),
//! read on a thread of their own so a test can wait for one with a deadline instead of polling.

use std::io::{BufRead, BufReader, Read};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::Instant;

pub struct Lines {
    receiver: Receiver<String>,
    /// Every line received so far: a wait also finds a line that came before it started.
    seen: Vec<String>,
}

impl Lines {
    /// Reads `source` until it ends; the thread ends with it.
    pub fn read(source: impl Read + Send + 'static) -> Self {
        let (sender, receiver) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(source).lines() {
                let Ok(line) = line else { return };
                if sender.send(line).is_err() {
                    return;
                }
            }
        });
        Lines {
            receiver,
            seen: Vec::new(),
        }
    }

    /// The first line for which `matches` holds, waiting for it until `deadline`; `None` if it
    /// did not come by then or the source ended without it.
    pub fn wait_for(&mut self, deadline: Instant, matches: impl Fn(&str) -> bool) -> Option<&str> {
        if let Some(at) = self.seen.iter().position(|line| matches(line)) {
            return Some(&self.seen[at]);
        }
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self.receiver.recv_timeout(left).ok()?;
            let found = matches(&line);
            self.seen.push(line);
            if found {
                return self.seen.last().map(String::as_str);
            }
        }
    }

    /// Waits until the source ends, so that `text` then holds all of it; false if it had not
    /// ended by `deadline`.
    pub fn wait_for_end(&mut self, deadline: Instant) -> bool {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.receiver.recv_timeout(left) {
                Ok(line) => self.seen.push(line),
                Err(RecvTimeoutError::Disconnected) => return true,
                Err(RecvTimeoutError::Timeout) => return false,
            }
        }
    }

    /// Everything received so far, without waiting.
    pub fn text(&mut self) -> String {
        self.seen.extend(self.receiver.try_iter());
        self.seen.join("\n")
    }
}
